"""Stage 2 of the data path: the tail sampler. Episodes are held per (step, split) until the step closes; a policy decides which whole episodes are kept (across ranks too)."""
