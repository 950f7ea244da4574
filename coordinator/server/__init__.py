"""The HTTP face of the coordinator: the aiohttp routes and the dashboard."""
