"""``convert(model)``: replace recognized BatchNorm → ReLU → Conv structures of a model with fused modules.

What is recognized
    * Pre-activation residual blocks whose children are named like timm's ``resnetv2``
      (``PreActBasic`` / ``PreActBottleneck``: ``norm1, conv1, norm2, conv2[, norm3, conv3]``,
      ``downsample``, ``drop_path``; the norms are ``BatchNormAct2d``, i.e. a ``BatchNorm2d`` with
      its own ``act`` and ``drop``), or like the widely copied CIFAR code (kuangliu/pytorch-cifar
      ``PreActBlock`` / ``PreActBottleneck`` and :mod:`fused_preact.models`: plain ``nn.BatchNorm2d``
      ``bn1, conv1, bn2, conv2[, bn3, conv3]`` with ``F.relu`` in forward, and ``shortcut``: absent,
      ``None``, a 1×1 conv or an ``nn.Sequential`` holding one). Such a block is replaced by a
      :class:`ConvertedPreActBlock` that adopts the block's children under the same names.
    * Runs of consecutive children of an exact ``nn.Sequential``: ``nn.BatchNorm2d → nn.ReLU →
      nn.Conv2d`` (pre-activation DenseNet layers, Wide ResNet blocks) or timm
      ``BatchNormAct2d → nn.Conv2d`` (the deep stem of the ``resnetv2_*d`` models). The Sequential
      becomes a :class:`FusedSequential` (its class is changed in place; children, indices, hooks
      and attributes stay), whose forward runs each recorded run as one fused op.

Only ``type(conv) is nn.Conv2d`` with ``padding_mode='zeros'`` and integer padding is fused (subclasses
such as timm's ``StdConv2d`` or ``Conv2dSame`` change the computation); only ``nn.ReLU`` activations and
an ``nn.Identity`` ``BatchNormAct2d.drop`` are fused. Modules with hooks that the fused path would
bypass are left alone (hooks registered globally with ``nn.modules.module.register_module_forward_hook``
are not looked at). Everything not converted is listed with its reason in the
:class:`ConversionReport`.

What the converted block computes
    The original's forward, as far as a numeric probe can tell (see ``verify``). A block's shortcut is
    read in one of five ways; the first that reproduces the block is used:

    ``identity on raw x``              ``x + F(x)`` (timm, the paper, kuangliu).
    ``projection fused with conv1``    the 1×1 projection reads the pre-activation ``relu(bn1(x))``
                                       (timm ``DownsampleConv``, kuangliu, the paper): bn1's
                                       statistics are computed once and feed conv1 and the projection.
    ``shortcut module on pre-activation``  any other shortcut module reading ``relu(bn1(x))``, e.g.
                                       timm ``DownsampleAvg`` (average pool, then 1×1 conv): the
                                       pre-activation is materialized once by the unfused
                                       ``bn1`` → ReLU and read by conv1 and the shortcut; the later
                                       BN → ReLU → Conv steps are fused. The pooled projection
                                       reads a quarter of the pixels, so fusing bn1 into it would
                                       save little and cost a second statistics pass.
    ``identity on pre-activation``     ``relu(bn1(x)) + F(x)`` (seen in some snippets): as above.
    ``shortcut module on raw x``       the shortcut (e.g. a projection) reads the raw input, as in
                                       some codebases; it runs unfused, the residual branch fused.

Verification (``verify=True``, the default)
    A block's forward cannot be checked by name (a kuangliu look-alike may project the raw input),
    so every candidate is probed before anything is replaced: a deep copy of the original, its
    parameters and buffers re-drawn at random (so zero-initialized last convs cannot hide a
    difference), and a converted copy of it running ``backend="reference"`` are run in float64 on
    two random (2, C, S, S) images (S = 4 unless the convs need more), in eval mode and then in
    training mode, then in training mode on 5 images scaled by 8 (a forward that depends on the batch
    or the scale — ghost batches, a clamp — differs there), with the same RNG seed (so ``DropPath``
    draws the same mask). Outputs, input gradients, parameter gradients and buffers must agree to
    1e-6 (relative, max-norm), and each forward must leave the generators in the same state (a
    block that draws random numbers in its forward, e.g. stochastic depth written inline, is not
    converted). What the probe cannot see — a branch taken only on other inputs — it cannot
    refuse. After conversion, a BN or conv child swapped for another class, or a hook added to one
    of the fused children (a BatchNormAct2d's ``act``/``drop`` included), makes the fused module
    run its children eagerly, with the reason. The probe
    runs on the block's own device (where its parameters and buffers are; a block spread over
    several devices is not converted) and allocates nothing elsewhere; it seeds only the CPU
    generator and that device's generator and restores both, so the global RNG state, and the
    model's device, dtype, ``training`` flags, parameters and buffers, are as they were before
    ``convert``. Probe results are reused for modules with the same class, ``repr``, plain
    attributes (private ones of plain types too) and devices (the repeated blocks of a stage), so a ResNet-152 costs about a dozen
    probes, each two deep copies of one block.

Source semantics copied: timm 1.0 ``timm/models/resnetv2.py`` (``PreActBasic``,
``PreActBottleneck``, ``DownsampleConv``, ``DownsampleAvg``, ``create_resnetv2_stem``) and
``timm/layers/norm_act.py`` (``BatchNormAct2d``: ``act(drop(batch_norm(x)))``); He et al., "Identity
Mappings in Deep Residual Networks", ECCV 2016, Fig. 4(e) and §4.

Layout: :mod:`.matching` (what is recognized, why something is left alone), :mod:`.probing` (the
numeric check), :mod:`.blocks` (the modules put in place) and :mod:`.report` (what was done), all used
by :mod:`.converter` (the walk).
"""

from fused_preact.conversion.blocks import ConvertedPreActBlock, FusedSequential
from fused_preact.conversion.converter import convert
from fused_preact.conversion.report import ConversionReport, Replaced, Skipped

__all__ = ["ConversionReport", "ConvertedPreActBlock", "FusedSequential", "Replaced", "Skipped", "convert"]
