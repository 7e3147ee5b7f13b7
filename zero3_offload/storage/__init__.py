"""Files of the disk tiers: the rank's directory and preallocated record files."""

from zero3_offload.storage.rank_directory import RankDirectory
from zero3_offload.storage.record_file import ALIGN, RecordFile, aligned

__all__ = ["ALIGN", "RankDirectory", "RecordFile", "aligned"]
