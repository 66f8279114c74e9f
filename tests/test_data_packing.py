"""Packing without Ray: uint16 blocks when the vocabulary fits, int32 otherwise; no token lost or duplicated at
block or push boundaries; prepared shards keep the dtype and the tokens."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.config import DataConfig
from pipeline.data.packing import BlockPacker, block_dtype
from pipeline.data.prepared import _write_split, read_pieces


@pytest.mark.parametrize("vocab, dtype", [(257, np.uint16), (4096, np.uint16), (65536, np.uint16),
                                          (65537, np.int32), (100277, np.int32), (200019, np.int32)])
def test_block_dtype_is_uint16_exactly_when_every_id_fits(vocab, dtype):
    assert block_dtype(vocab) == np.dtype(dtype)
    assert np.iinfo(block_dtype(vocab)).max >= vocab - 1


@pytest.mark.parametrize("vocab", [4096, 100277])
def test_packer_conserves_the_stream_across_any_push_sizes(vocab):
    rng = np.random.default_rng(vocab)
    block_len, dtype = 33, block_dtype(vocab)
    stream = rng.integers(0, vocab, size=5000)
    stream[:3] = vocab - 1  # the largest id survives the cast
    packer = BlockPacker(block_len, dtype)
    cuts = np.sort(rng.choice(np.arange(1, len(stream)), size=40, replace=False))
    pieces = np.split(stream, cuts) + [stream[:0]]  # sizes from 1 to hundreds, and an empty push
    got_idx, got_blocks = [], []
    for piece in pieces:
        idx, blocks = packer.push(piece)
        assert blocks.dtype == dtype and blocks.shape == (len(idx), block_len)
        got_idx.append(idx)
        got_blocks.append(blocks)
    idx, blocks = np.concatenate(got_idx), np.concatenate(got_blocks)
    k = len(stream) // block_len
    assert idx.tolist() == list(range(k)) and packer.next_index == k
    assert np.array_equal(blocks.reshape(-1).astype(np.int64), stream[: k * block_len])
    assert packer.tail_tokens == len(stream) - k * block_len  # the final partial block, counted


def test_packer_refuses_ids_its_dtype_cannot_hold():
    with pytest.raises(ValueError, match="outside uint16 range"):
        BlockPacker(8, np.uint16).push(np.array([1, 65536]))
    with pytest.raises(ValueError, match="outside int32 range"):
        BlockPacker(8, np.int32).push(np.array([-1, 2]))


class _Blocks:
    """What _write_split reads: a dataset's iter_batches of {"index", "tokens"} in index order."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def iter_batches(self, batch_size, batch_format):
        for s in range(0, len(self.tokens), batch_size):
            end = min(s + batch_size, len(self.tokens))
            yield {"index": np.arange(s, end), "tokens": self.tokens[s:end]}


@pytest.mark.parametrize("vocab", [4096, 100277])
def test_prepared_shards_keep_dtype_and_tokens(tmp_path, vocab):
    cfg = DataConfig(seq_len=15, shard_blocks=7, row_group_blocks=3)
    dtype = block_dtype(vocab)
    tokens = np.random.default_rng(0).integers(0, vocab, size=(30, cfg.block_len)).astype(dtype)
    shards = _write_split(_Blocks(tokens), tmp_path / "train", cfg, "train", progress=False)
    assert [s["blocks"] for s in shards] == [7, 7, 7, 7, 2] and [s["first_index"] for s in shards][-1] == 28
    # Every shard in row groups of row_group_blocks (the unit dealt to ranks), read back one row group at a time:
    # all of them in order, as one rank's share would be, positions from local_first, those from 10 on.
    items, local = [], 0
    for s in shards:
        meta = pq.ParquetFile(tmp_path / s["path"]).metadata
        assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == ([3, 3, 1] if s["blocks"] == 7 else [2])
        for g in range(meta.num_row_groups):
            items.append({"path": str(tmp_path / s["path"]), "row_group": g, "first_index": local, "local_first": local})
            local += meta.row_group(g).num_rows
    batches = list(read_pieces(pa.Table.from_pylist(items), start_block=10, block_len=cfg.block_len))
    index = np.concatenate([b["index"] for b in batches])
    read = np.concatenate([b["tokens"] for b in batches])
    assert index.tolist() == list(range(10, 30)) and read.dtype == dtype
    assert np.array_equal(read, tokens[10:])
    # A row group that does not hold the blocks the manifest places there is an error.
    items[1]["first_index"] += 1
    with pytest.raises(RuntimeError, match="row group 1: holds blocks \\[3, 4, 5\\].*places blocks 4"):
        list(read_pieces(pa.Table.from_pylist(items[:2]), start_block=0, block_len=cfg.block_len))
