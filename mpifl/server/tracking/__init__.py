"""Live experiment tracking from rank 0 (``--track tensorboard,mlflow,wandb``): the trackers of a run and their
threads (:mod:`.live`), what a tracker does (:mod:`.tracker`), and one module per tracker (``to_<name>.py``)."""
