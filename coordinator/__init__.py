"""The project host: holds the model, cuts its products into verified work units,
serves volunteers. Sub-packages by layer, dependencies pointing down: work, rules, state,
training at the bottom; engine above them; server and cli on top."""
