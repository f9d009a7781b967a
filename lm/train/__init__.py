"""Training: a TOML-configured loop with evaluation, checkpoints, exact resume and DDP.

load_config / Config      the run's configuration (dataclasses read from TOML; check_config checks one made in Python)
Trainer / train           the loop; ``Trainer(cfg).run()`` returns an exit status
TrainingDiverged          raised when the loss or gradient norm stops being finite
TrainingInterrupted       for a caller that stops with a run a signal stopped (``run()`` returned 128 + signal)
plot_runs                 train/validation loss curves of run directories, as a PNG
"""

from lm.train.config import Config, check_config, config_from_dict, load_config
from lm.train.metrics import read_metrics
from lm.train.plot import plot_runs
from lm.train.trainer import Trainer, TrainingDiverged, TrainingInterrupted, train

__all__ = [
    "Config",
    "Trainer",
    "TrainingDiverged",
    "TrainingInterrupted",
    "check_config",
    "config_from_dict",
    "load_config",
    "plot_runs",
    "read_metrics",
    "train",
]
