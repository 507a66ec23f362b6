"""Workarounds that make a transformers-5 target survive pickling (``ddp_spawn`` pickles the module).

:func:`strip_output_capturing_hooks` before pickling, :func:`register_output_recording` after
unpickling; both are no-ops on transformers versions that install no such hooks or registry.
"""

from __future__ import annotations

from torch import nn


def strip_output_capturing_hooks(model: nn.Module) -> None:
    """Remove the forward hooks transformers 5 installs the first time a model returns hidden states.

    They are local functions, which cannot be pickled (``ddp_spawn`` pickles the module and with it
    the target); transformers installs them again on the next forward that needs them.
    """
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__qualname__", "").endswith("output_capturing_hook"):
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False


def register_output_recording(model: nn.Module) -> None:
    """Make an unpickled transformers-5 model return hidden states again.

    transformers records which outputs a model class can capture in a registry filled by the
    model's ``__init__``; a model unpickled in a fresh process (``ddp_spawn``) never ran it there, so
    ``output_hidden_states=True`` would silently return None. Fill the registry from the instances.
    """
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY as registry
    except ImportError:  # other transformers versions: nothing to do
        return
    for module in model.modules():
        # keyed on str(class) in every version that has it (5.18: a plain dict; later: a dict subclass that
        # converts a model key itself), so write and read through dict's own methods with that key
        key = str(module.__class__)
        if getattr(module, "_can_record_outputs", None) is not None and not dict.get(registry, key):
            dict.__setitem__(registry, key, module._can_record_outputs)
