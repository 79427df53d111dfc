"""Prefix sharing on a paged KV cache, with copy-on-write (Kwon et al. 2023, section 4), in plain PyTorch.

A paged cache (``attnlab.kvcache.to_paged``, lesson 10) finds each sequence's keys and values
through a *block table*: entry ``n`` of sequence ``b``'s row names the physical block that
holds its tokens ``n * block_size .. (n + 1) * block_size - 1``. Nothing says two rows must
name different blocks. vLLM (Kwon et al. 2023, section 4.4) lets the sequences that share a
prompt (parallel sampling, beam search, a common system prompt) point at the *same* physical
blocks for it, and counts for each block how many sequences use it (its reference count):

* forking a sequence copies its block table, not its blocks (each reference count + 1);
* a sequence that appends into a block it shares (the prompt's partly filled last block)
  first copies that block to a fresh one and writes there (**copy-on-write**); the old block
  loses one reference. A block used by one sequence only is written in place;
* a full block is never written again, so a shared prompt's full blocks stay shared for good;
* a block whose count drops to 0 returns to the free list.

Decoding is unchanged: ``attnlab.kernels.flash_decode(..., block_table=...)`` reads through
the tables and gives, for every sequence, exactly what its own contiguous cache gives.

:class:`PagedKVPool` is the allocator; :func:`prefix_sharing_blocks` counts the blocks with and
without sharing by formula (equal to the pool's count in the tests).

Shapes: pools k, v (num_blocks, H_kv, block_size, D); a sequence's K, V (H_kv, T, D); block
tables (B, max_blocks) int32, lengths (B,) int32, as ``flash_decode`` takes them.

Example::

    pool = PagedKVPool(64, kv_heads=2, block_size=16, head_dim=16)
    a = pool.new_sequence(); pool.append(a, k_prompt, v_prompt)     # (2, 37, 16) each
    b = pool.fork(a)                                                # shares a's 3 blocks
    pool.append(b, k_b, v_b)                                        # copies the 3rd block first
    o = flash_decode(q, pool.k, pool.v, pool.seqlens([a, b]), block_table=pool.block_table([a, b]))
"""

from __future__ import annotations

import torch

from attnlab import validate
from attnlab.kvcache import gather_cache

__all__ = ["PagedKVPool", "prefix_sharing_blocks"]


class PagedKVPool:
    """A pool of ``num_blocks`` physical KV blocks of ``block_size`` tokens, with reference counts,
    block tables per sequence, sharing by :meth:`fork` and copy-on-write in :meth:`append`.

    ``k``, ``v``: (num_blocks, kv_heads, block_size, head_dim); ``refcount``: (num_blocks,) long;
    ``tables[seq]``: that sequence's list of block numbers; ``lengths[seq]``: its tokens;
    ``copies``: copy-on-write copies made so far; ``blocks_in_use`` and ``bytes_in_use``.

    Example: ``pool = PagedKVPool(64, 2, 16, 16); s = pool.new_sequence(); pool.append(s, k, v)``
    """

    def __init__(self, num_blocks, kv_heads, block_size, head_dim, *, dtype=torch.float32, device="cpu"):
        for name, val in (("num_blocks", num_blocks), ("kv_heads", kv_heads), ("block_size", block_size),
                          ("head_dim", head_dim)):
            validate.integer(val, name)
        self.k = torch.zeros((num_blocks, kv_heads, block_size, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.refcount = torch.zeros(num_blocks, dtype=torch.long)
        self.free = list(range(num_blocks - 1, -1, -1))    # pop() hands out block 0 first
        self.tables, self.lengths = {}, {}
        self.copies = 0
        self._next_id = 0

    @property
    def block_size(self):
        return self.k.shape[2]

    @property
    def blocks_in_use(self):
        return int((self.refcount > 0).sum())

    @property
    def bytes_in_use(self):
        """K and V bytes of the blocks in use."""
        per_block = 2 * self.k[0].numel() * self.k.element_size()
        return self.blocks_in_use * per_block

    def _alloc(self):
        if not self.free:
            raise RuntimeError(f"PagedKVPool: all {self.k.shape[0]} blocks are in use")
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def _release(self, block):
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)

    def _check_seq(self, seq):
        if seq not in self.tables:
            raise ValueError(f"seq: expected a live sequence id (one of {sorted(self.tables)}), got {seq!r}")

    def new_sequence(self):
        """A new, empty sequence; returns its id."""
        seq = self._next_id
        self._next_id += 1
        self.tables[seq], self.lengths[seq] = [], 0
        return seq

    def fork(self, seq):
        """A new sequence that shares every block of ``seq`` (its table copied, each block's count
        + 1; no K or V is copied). Returns the new id."""
        self._check_seq(seq)
        child = self.new_sequence()
        self.tables[child] = list(self.tables[seq])
        self.lengths[child] = self.lengths[seq]
        for block in self.tables[seq]:
            self.refcount[block] += 1
        return child

    def append(self, seq, k_new, v_new):
        """Write ``k_new``, ``v_new`` (kv_heads, T, head_dim) after sequence ``seq``'s tokens.

        Into the last block while it has room (copied first if another sequence shares it:
        copy-on-write), then into fresh blocks. Example: ``pool.append(s, k[:, :5], v[:, :5])``
        """
        self._check_seq(seq)
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            validate.tensor(x, name, 3, "(kv_heads, new tokens, head_dim)", floating=True)
            if x.shape[0] != self.k.shape[1] or x.shape[2] != self.k.shape[3]:
                raise ValueError(f"{name}: expected shape ({self.k.shape[1]}, T, {self.k.shape[3]}) "
                                 f"(kv_heads, new tokens, head_dim), got {tuple(x.shape)}")
        if v_new.shape != k_new.shape:
            raise ValueError(f"v_new: expected shape {tuple(k_new.shape)} like k_new, got {tuple(v_new.shape)}")
        table, bs = self.tables[seq], self.block_size
        done, T = 0, k_new.shape[1]
        while done < T:
            offset = self.lengths[seq] % bs                               # rows used in the last block
            if offset == 0:                                               # the last block is full (or none): a new one
                table.append(self._alloc())
            elif self.refcount[table[-1]] > 1:                            # shared and partly filled: copy on write
                old, new = table[-1], self._alloc()
                self.k[new, :, :offset] = self.k[old, :, :offset]         # read and write offset rows of K and V
                self.v[new, :, :offset] = self.v[old, :, :offset]
                self._release(old)
                table[-1] = new
                self.copies += 1
            n = min(bs - offset, T - done)                                # tokens that fit in this block
            block = table[-1]
            self.k[block, :, offset:offset + n] = k_new[:, done:done + n]
            self.v[block, :, offset:offset + n] = v_new[:, done:done + n]
            self.lengths[seq] += n
            done += n

    def free_sequence(self, seq):
        """Drop sequence ``seq``: each of its blocks loses a reference; unused blocks return to the free list."""
        self._check_seq(seq)
        for block in self.tables.pop(seq):
            self._release(block)
        del self.lengths[seq]

    def block_table(self, seqs):
        """(len(seqs), max blocks) int32: the sequences' tables, padded with 0, for ``flash_decode``."""
        for s in seqs:
            self._check_seq(s)
        width = max([len(self.tables[s]) for s in seqs] + [1])
        table = torch.zeros((len(seqs), width), dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, :len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        return table.to(self.k.device)

    def seqlens(self, seqs):
        """(len(seqs),) int32: the sequences' lengths."""
        for s in seqs:
            self._check_seq(s)
        return torch.tensor([self.lengths[s] for s in seqs], dtype=torch.int32, device=self.k.device)

    def gather(self, seq):
        """Sequence ``seq``'s (k, v), each (kv_heads, length, head_dim), read through its table
        (``attnlab.kvcache.gather_cache``)."""
        table = self.block_table([seq])
        L = self.lengths[seq]
        return gather_cache(self.k, 0, L, table), gather_cache(self.v, 0, L, table)


def prefix_sharing_blocks(prefix_len, suffix_lens, block_size):
    """Blocks for ``len(suffix_lens)`` sequences that share a prompt of ``prefix_len`` tokens (one
    prefilled, the others forked from it) and then append ``suffix_lens[i]`` tokens each.

    Unshared: ``sum_i ceil((P + s_i) / bs)``. Shared: the prompt's ``ceil(P / bs)`` blocks once,
    plus each sequence's blocks after them, ``ceil((P + s_i) / bs) - ceil(P / bs)``, plus the
    copy-on-write copies of a partly filled last prompt block: one per sequence that appends,
    except the last writer when every sequence appends (it finds the block no longer shared).
    Returns {"shared", "unshared", "copies", "saved"} (blocks).

    Example: ``prefix_sharing_blocks(1000, [50, 80, 20, 200], 16)["saved"]``
    """
    validate.integer(prefix_len, "prefix_len", minimum=0)
    validate.integer(block_size, "block_size")
    if not isinstance(suffix_lens, (list, tuple)):
        raise TypeError(f"suffix_lens: expected a list of ints (one per sequence), got {type(suffix_lens).__name__}")
    suffix_lens = [validate.integer(s, "suffix_lens", minimum=0) for s in suffix_lens]
    if not suffix_lens:
        raise ValueError("suffix_lens: expected at least one sequence, got none")
    ceil = lambda n: -(-n // block_size)                                 # noqa: E731
    unshared = sum(ceil(prefix_len + s) for s in suffix_lens)
    writers = sum(1 for s in suffix_lens if s > 0)
    copies = 0
    if prefix_len % block_size:
        copies = writers - 1 if writers == len(suffix_lens) else writers
    shared = ceil(prefix_len) + copies + sum(ceil(prefix_len + s) - ceil(prefix_len) for s in suffix_lens)
    return {"shared": shared, "unshared": unshared, "copies": copies, "saved": unshared - shared}
