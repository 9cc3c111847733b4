"""Stage 3, run: read -> quantize -> write, overlapped, with bounded memory.

pipeline.py  the reader, quantizing and writer threads, and the hand-offs between them
reader.py    one batch's bytes into one device buffer; prefetch.py fills the page cache ahead of it
quantizer.py one batch's outputs (numerics.py and fp4.py: the math)
writer.py    runs streamed into preallocated shards, with the Linux file calls that keep them cheap
device.py    the device, its memory budget and its threads; progress.py the bar or log lines
warmup.py    torch imported (and CUDA started) in the background; startup_pages.py its recorded pages
"""
