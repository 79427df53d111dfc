"""Attention across devices on ``torch.distributed``: ring attention and all-to-all (Ulysses) sequence parallelism.

When a sequence outgrows one device, its positions are sharded across ``P`` ranks. An MLP needs nothing
from the other shards (it acts on each position alone); attention does, since every query reads every key.
Two exact ways to give it them:

* :func:`ring_attention` (Liu, Zaharia and Abbeel 2023): K/V shards travel round a ring, each transfer
  overlapping the compute on the previous shard, partial results merged by their log-sum-exp (lesson 07's
  online softmax); ``layout="zigzag"`` balances the work under a causal mask (Brandon et al. 2023).
* :func:`ulysses_attention` (Jacobs et al. 2023): two all-to-alls re-shard from positions to heads and back.
* :func:`allgather_attention` (Llama 3, arXiv:2407.21783): all-gather K and V, attend the local queries;
  its backward reduce-scatters dK and dV (grouped-query K/V heads allowed).

Both are autograd-exact (O, dQ, dK, dV equal single-device attention's) and count what they send in a
:class:`Trace` (bytes per rank, equal to :func:`attnlab.iomodel.ring_attention_bytes` and
:func:`attnlab.iomodel.ulysses_attention_bytes`, and a timeline of compute against communication).
:func:`launch` starts a local group (gloo on CPUs, NCCL on GPUs) from a notebook or a script; the same code
runs under ``torchrun`` (:func:`init_from_env`). The rank functions lessons, tests and benchmarks launch
live in :mod:`attnlab.distributed.experiments`.

Example::

    from attnlab.distributed import launch, experiments
    errors = launch(experiments.exactness, 2, 64)   # one dict per rank: max |error| per method and gradient
"""

from .allgather import allgather_attention, gather_sequence
from .launch import init_from_env, launch, pick_backend, rank_device
from .ring import (LAYOUTS, attention_lse, block_backward, check_shards, chunk_ids, flash_lse, merge_partials,
                   ring_attention, shard, shard_indices, unshard)
from .trace import Event, Trace
from .ulysses import heads_to_seq, seq_to_heads, ulysses_attention

__all__ = ["launch", "init_from_env", "pick_backend", "rank_device", "ring_attention", "ulysses_attention",
           "merge_partials", "attention_lse", "flash_lse", "block_backward", "check_shards", "chunk_ids", "shard",
           "shard_indices", "unshard", "seq_to_heads", "heads_to_seq", "Trace", "Event", "LAYOUTS"]
__all__ += ["allgather_attention", "gather_sequence"]
