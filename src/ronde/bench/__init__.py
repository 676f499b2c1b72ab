"""Benchmarks shipped with ronde: ``python -m ronde.bench CASE`` (see ``--help``).

Each contender (ronde over each transport; the peers torch.distributed's Gloo backend,
mpi4py on MPICH and mpi4py on Open MPI, the MPIs each in a venv the driver creates on
first use) runs the same measurement loop (:mod:`ronde.bench._timing`) in its own job of
``np`` processes; the driver (:mod:`ronde.bench.__main__`) interleaves the contenders
over several rounds, prints one JSON line per point and tables of ratios against the
peers. Cases: allreduce, latency, allgather, broadcast, reducescatter, alltoall and
fusion (ResNet-50's gradient set, :mod:`ronde.bench._resnet`). ``python -m
ronde.bench._membw`` measures the memory bandwidth the allreduce numbers are bound by.
See docs/benchmarks.md for the method and a measured run.
"""
