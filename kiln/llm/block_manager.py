"""The paged KV cache's bookkeeping: which blocks each request holds, reference counts, and prefix
caching by hashed block contents (plain Python: tested exhaustively without torch).

The cache is `num_blocks` blocks of `block_size` token slots; a request's block table lists its
blocks in token order (slot of token t: table[t // block_size] * block_size + t % block_size).
Block 0 is never handed out: it is the null block, where padded slots (CUDA-graph batches padded to
a bucket) may write without harming anyone.

Prefix caching (vLLM v1's scheme, as nano-vllm's): a *full* block is named by a hash chained over
its tokens and its parent's hash, so equal hashes mean equal whole prefixes. A block whose tokens
are known keeps its hash after its request frees it; a later request with the same prefix takes it
(reference count up) instead of computing it. Free blocks wait in one LRU queue: allocation takes
the front, evicting the block's hash if it had one; a request's freed blocks join the back in
reverse order, so its last blocks are evicted before its first ones, which others more likely share.
A prompt hit in full still recomputes its last token (its logits are needed): hits stop one token short.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.llm.config import LLMError
from kiln.llm.request import Request

NULL_BLOCK = 0


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """sha256 over the parent block's hash and this block's token ids: equal hashes, equal prefixes."""
    digest = hashlib.sha256(parent if parent is not None else b"kiln-kv-root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is registered in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise LLMError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}: "
                           "give it more memory or a smaller block size")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_count = 1  # never free, never allocated
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.request_blocks: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}  # how many of a request's leading blocks are registered/checked
        self.prefix_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # -- state --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests (free blocks with a cached hash count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def block_ids(self, request_id: str) -> list[int]:
        return self.request_blocks.get(request_id, [])

    # -- prefix cache -------------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        size = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // size):
            hashes.append(hash_block(hashes[-1] if i else None, request.token_ids[i * size:(i + 1) * size]))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of the request's leading full blocks already in the cache, and the tokens it covers.

        Stops one token short of the whole request: the last token is always computed (its logits are sampled)."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(request)
        hits: list[int] = []
        for block_hash in request.block_hashes[:(request.num_tokens - 1) // self.block_size]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def reset_prefix_cache(self) -> int:
        """Forget the hash of every block no request holds; returns how many were forgotten."""
        forgotten = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.hash is not None:
                del self.cached[block.hash]
                block.hash = None
                forgotten += 1
        return forgotten

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens of `request` (draft tokens included), after its
        `computed_blocks` prefix hits when it is being admitted. Returns the newly taken blocks, or None
        (and changes nothing) when too few are free."""
        held = self.request_blocks.get(request.request_id)
        if held is not None and not computed_blocks:  # a running request: most steps fit in the blocks it holds
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(held) * self.block_size:
                if self.enable_prefix_caching and min(end, request.num_tokens) // self.block_size > \
                        self.num_hashed.get(request.request_id, 0):
                    self._register_full_blocks(request, held, min(end, request.num_tokens) // self.block_size)
                return []
        computed_blocks = computed_blocks or []
        held = held if held is not None else []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        num_needed = max(total_blocks - len(held) - len(computed_blocks), 0)
        # a hit block no one holds sits in the free queue: taking it leaves one fewer free block
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_needed + num_revived > len(self.free_queue):
            return None
        if computed_blocks or request.request_id not in self.request_blocks:  # admission
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed_blocks) * self.block_size
        held = self.request_blocks.setdefault(request.request_id, held)
        for block_id in computed_blocks:
            self._touch(block_id)
        held.extend(computed_blocks)
        new_blocks = [self._take_free() for _ in range(num_needed)]
        held.extend(new_blocks)
        if self.enable_prefix_caching:
            known = min(num_computed + num_new_tokens, request.num_tokens)  # draft tokens are not known yet
            self._register_full_blocks(request, held, known // self.block_size)
        return new_blocks

    def free(self, request: Request) -> None:
        """Give back every block of the request (finished, aborted or preempted), last block first."""
        self.num_hashed.pop(request.request_id, None)
        for block_id in reversed(self.request_blocks.pop(request.request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def _register_full_blocks(self, request: Request, held: list[int], num_full: int) -> None:
        self._update_hashes(request)
        start = self.num_hashed.get(request.request_id, 0)
        for i in range(start, num_full):
            block = self.blocks[held[i]]
            block_hash = request.block_hashes[i]
            if block.hash is None and block_hash not in self.cached:  # a duplicate stays unregistered
                block.hash = block_hash
                self.cached[block_hash] = block.block_id
        self.num_hashed[request.request_id] = max(start, num_full)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
