"""Stage 1 of the data path: the recording API (``episode``, ``@traced``) turns user calls into light span records held per episode, on the training thread."""
