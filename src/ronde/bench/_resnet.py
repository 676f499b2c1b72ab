"""ResNet-50's gradient set: the shapes of its 161 trainable tensors, computed.

The layout is torchvision's ``resnet50`` (bottleneck blocks, expansion 4, stride on the
3x3 convolution, ``[3, 4, 6, 3]`` blocks, 1000 classes), walked here in
``named_parameters()`` order: the stem (7x7 convolution, batch norm), then per block
conv1 (1x1), bn1, conv2 (3x3), bn2, conv3 (1x1), bn3 and, for the first block of each
stage, the downsample (1x1 convolution, batch norm), then the classifier. Convolutions
have no bias; each batch norm has a weight and a bias. 161 tensors, 25,557,032 values.
"""

from __future__ import annotations

from functools import lru_cache

Shape = tuple[int, ...]

STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))  # (bottleneck width, blocks)
EXPANSION = 4
NUM_CLASSES = 1000


def _bn(c: int) -> list[Shape]:
    return [(c,), (c,)]  # weight, bias (running statistics are buffers, not gradients)


@lru_cache(maxsize=1)
def resnet50_grad_shapes() -> tuple[Shape, ...]:
    """The gradient shapes of ResNet-50, in parameter order."""
    shapes: list[Shape] = [(64, 3, 7, 7), *_bn(64)]
    inplanes = 64
    for width, blocks in STAGES:
        out = width * EXPANSION
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), *_bn(width),
                       (width, width, 3, 3), *_bn(width),
                       (out, width, 1, 1), *_bn(out)]
            if b == 0:
                shapes += [(out, inplanes, 1, 1), *_bn(out)]
            inplanes = out
    shapes += [(NUM_CLASSES, inplanes), (NUM_CLASSES,)]
    return tuple(shapes)
