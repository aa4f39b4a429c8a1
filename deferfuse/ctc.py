"""CTC loss with its lengths given as tensors (``_ctc_loss.Tensor`` and its backward), as CUDA
runs it: the lengths are read to the host once (a sync) and the int-list overloads, lowered in
``runtime/lowering/losses.py``, do the work."""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _ints(t):
    return t.tolist() if isinstance(t, torch.Tensor) else list(t)


def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0,
                    zero_infinity=False):
    return aten._ctc_loss.default(log_probs, targets, _ints(input_lengths), _ints(target_lengths),
                                  blank, zero_infinity)


def ctc_loss_backward_tensor(grad, log_probs, targets, input_lengths, target_lengths,
                             neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    return aten._ctc_loss_backward.default(grad, log_probs, targets, _ints(input_lengths),
                                           _ints(target_lengths), neg_log_likelihood, log_alpha,
                                           blank, zero_infinity)


DECOMPOSITIONS = {aten._ctc_loss.Tensor: ctc_loss_tensor,
                  aten._ctc_loss_backward.Tensor: ctc_loss_backward_tensor}
