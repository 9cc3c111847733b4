"""Stage 1, source: what the checkpoint holds (a local directory or a Hub repo), from headers alone.

checkpoint.py  the Source dataclass and the checks every source passes
local.py       a local directory
hub.py         a Hub repo: pinned commit, remote headers, downloads into the cache
streaming.py   --stream-download: a few source shards on disk at a time
resolve.py     what SRC names (a directory or a repo id), and the source a run or a manifest needs
"""
