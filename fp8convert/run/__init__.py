"""Stage 3, run: read -> quantize -> write, overlapped, with bounded memory.

pipeline.py   the run: a reader thread, the quantizing main thread and a writer thread
reader.py     bytes of one batch into one device buffer (parallel preads, pinned staging on CUDA)
prefetch.py   the page cache filled ahead of the reader
numerics.py   the FP8 math: scales and codes (pure tensor functions)
quantizer.py  one batch's outputs from its input buffer
writer.py     tensors streamed into preallocated shards, each finished by fsync and rename
writeback.py  dirty pages handed to the disk at once
progress.py   the progress bar or log lines
device.py     which device and how much memory a batch may use
warmup.py     torch imported (and CUDA started) in the background while the run reads ahead
startup_pages.py  torch's recorded start-up pages read ahead, so its cold import waits less
"""
