"""The run directory: every file name a run writes (:mod:`.names`), checking and claiming the directory
(:mod:`.directory`), making it and every write into it (:mod:`.rundir`, through :mod:`.files`), and the verified
checkpoints of server and client ranks (:mod:`.checkpoint`)."""
