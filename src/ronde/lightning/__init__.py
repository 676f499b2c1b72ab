"""PyTorch Lightning on ronde.

* ``Trainer(strategy="ronde")`` (or ``strategy=RondeStrategy()``): data-parallel training
  under any launcher (``strategy.py``; importing this package registers the name).
* :func:`elastic_fit`: ``Trainer.fit`` under elastic ``ronderun --min-np/--max-np``,
  committed in memory at every epoch's end and resumed after a lost or added rank
  (``elastic.py``).

docs/lightning.md has the details and what differs from ``DDPStrategy``. Importing
``ronde`` never imports this package (nor Lightning).
"""

from __future__ import annotations

from .elastic import LightningState, elastic_fit
from .strategy import COMMITTED, RondeEnvironment, RondeStrategy

__all__ = ["COMMITTED", "LightningState", "RondeEnvironment", "RondeStrategy", "elastic_fit"]
