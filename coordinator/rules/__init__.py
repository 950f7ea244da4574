"""Pure decisions: the transitioner, the scheduler, the validator, host trust, access limits."""
