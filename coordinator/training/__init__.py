"""The training job: project settings, corpus, tiny-gpt, AdamW, checkpoints, the training
loop, sampling."""
