"""The running coordinator: a small Coordinator that wires work requests, reports,
validation passes, products and operator actions."""
