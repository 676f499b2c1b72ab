"""ronde on Ray: ``RayExecutor``, Horovod's ``horovod.ray`` API.

::

    import ray
    from ronde.ray import RayExecutor

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4)
    executor.start()
    results = executor.run(train_fn, args=(config,))   # train_fn calls ronde.init()
    executor.shutdown()

Each worker is a Ray actor, placed with a placement group (``cpus_per_worker`` CPUs,
``gpus_per_worker`` GPUs each); ranks are dealt host by host (actors on one Ray node get
consecutive ranks and one ``local_rank`` each), the rendezvous service runs in the
driver (this process), and each actor gets the job secret in its environment. Inside a
worker a plain ``ronde.init()`` (or ``ronde.torch.init()``...) finds its place. Needs
``pip install 'ronde[ray]'`` (imported on first use). ``min_workers``/``max_workers``
make the job elastic (``ronde/ray/elastic.py``). See docs/ray.md.
"""

from __future__ import annotations

from .executor import ElasticRayExecutor, RayExecutor, RaySettings

__all__ = ["ElasticRayExecutor", "RayExecutor", "RaySettings"]
