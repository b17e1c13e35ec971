"""``AppState``: a Stateful wrapper for a model, its optimizer and other training state.

The same pattern as DCP's tutorial ``AppState``: ``get_state_dict`` /
``set_state_dict`` from ``torch.distributed.checkpoint.state_dict`` handle FSDP
FQNs and give sharded (DTensor) state dicts, and initialize empty optimizer
state on a fresh optimizer so it can be loaded in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .overlap import guard_optimizer
from .state import is_stateful


class AppState:
    """Checkpointable training state: ``model``, optional ``optimizer`` and named ``extras``.

    A Stateful for a model, and its optimizer through ``get_state_dict`` /
    ``set_state_dict``, which also initializes a fresh optimizer's state so it loads
    in place. Pass it to ``rayckpt.save`` and ``rayckpt.load`` inside a dict
    (``{"app": app}``); its state is stored under ``model``, ``optim`` and
    ``extra.<name>``. Its optimizer is guarded (``guard_optimizer``): an overlapped async
    save copies the model's parameters and the optimizer's state beside the next
    forward and backward, and the optimizer's step waits for that copy.

    Args:
        model: The model (FSDP2-sharded or not).
        optimizer: Its optimizer; None: the model alone.
        **extras: Named further state: Stateful objects (an LR scheduler, a data
            loader with ``state_dict``), tensors, or plain JSON-able values. Plain
            values are restored into ``self.extras`` after a load.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extras: Any):
        self.model = model
        self.optimizer = optimizer
        self.extras = extras
        if optimizer is not None:  # its steps wait for a save's copy still running beside them
            guard_optimizer(optimizer)

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        else:
            sd = {"model": get_state_dict(self.model, [])[0]}
        for name, extra in self.extras.items():
            sd[f"extra.{name}"] = extra.state_dict() if is_stateful(extra) else extra
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is not None:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optim"],
            )
        else:
            set_state_dict(self.model, [], model_state_dict=state_dict["model"], optim_state_dict={})
        for name, extra in self.extras.items():
            value = state_dict[f"extra.{name}"]
            if is_stateful(extra):
                extra.load_state_dict(value)
            else:
                self.extras[name] = value
