"""ronde on Spark: ``ronde.spark.run``, Horovod's ``horovod.spark.run``.

::

    from pyspark.sql import SparkSession
    import ronde.spark

    spark = SparkSession.builder.getOrCreate()
    results = ronde.spark.run(train, args=(config,), num_proc=4)   # rank order

``fn`` runs in ``num_proc`` tasks of one *barrier* stage (all start together or none),
each calling ``ronde.init()`` as under ``ronderun``; the rendezvous service runs in the
driver. Needs ``pip install 'ronde[spark]'`` (imported on first use) and Java 17. See
docs/spark.md. Under Spark's own ``TorchDistributor`` a plain ``ronde.init()`` works
too (it reads torchrun's environment). ``ronde.spark.run_elastic`` runs an elastic job
on Spark tasks (``spark/elastic.py``).
"""

from __future__ import annotations

from .elastic import run_elastic
from .runner import run

__all__ = ["run", "run_elastic"]
