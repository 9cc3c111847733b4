"""Several processes, one conversion (or many): docs/cluster.md.

workers.py  which worker am I (launcher detection), which shards are mine, who finalizes
devices.py  one worker process per device of this machine (--devices)
batch.py    many models from one jobs file
"""
