"""`kvoffload bench ttft`'s raw-read floor (`raw_read_s`): the fs tier's own chunk files, read whole."""

from helpers import ROW, Rig, fs_tier, keys_for

from kvoffload.tools.bench.ttft import raw_read_s
from kvoffload.workers.chunkfile import HEADER_BYTES


def test_the_raw_read_reads_the_asked_number_of_the_tiers_chunk_files_whole(tmp_path):
    """It reads as many of the fs tier's chunk files as asked (all of them when asked for more),
    each whole (header page and payload), and nothing when asked for none."""
    with Rig([fs_tier(tmp_path)], num_slots=8) as rig:
        rig.store(keys_for(6))
    file_bytes = HEADER_BYTES + ROW
    seconds, nbytes = raw_read_s(tmp_path, 4, seed=1)
    assert nbytes == 4 * file_bytes and seconds > 0
    assert raw_read_s(tmp_path, 100, seed=2)[1] == 6 * file_bytes
    assert raw_read_s(tmp_path, 0, seed=3) == (0.0, 0)
