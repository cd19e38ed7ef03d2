"""The run directory: every file name a run writes (:mod:`.names`), making and claiming the directory, and
the verified checkpoints of server and client ranks."""
