"""Framework-neutral logic shared by the framework bindings (``ronde.torch``, later others).

Nothing here imports a deep-learning framework: each binding supplies a small
adapter (how to cast a tensor, how to test it for inf/nan, what its dtype is
called) and reuses the bookkeeping:

* :mod:`.compression`: ``Compression.none/fp16/bf16`` over an adapter, and the
  overflow policy of the 16-bit float wire formats.
* :mod:`.accumulation`: counting backward passes for ``backward_passes_per_step``.
* :mod:`.naming`: gradient names, duplicate checks, cross-rank consistency reports.
* :mod:`.host_reduce`: reducing a step's gradients on the host as numpy arrays
  (TensorFlow, Keras, JAX and MXNet): compression, sparse gradients, fused buffers.
* :mod:`.handles`: the async handle that converts the numpy result to the
  framework's tensors (the JAX and torch bindings' handles).
* :mod:`.state`: broadcasting a nested state (optimizer state dicts) whose leaves are
  tensors: the structure goes by ``broadcast_object``, the tensors by buffer broadcasts.
"""
