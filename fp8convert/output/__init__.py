"""Stage 4, output: the output directory as a whole.

manifest.py  OUT/.fp8convert/manifest.json, the record that makes runs resumable (its one reader and writer)
partial.py   the units already written in a partial shard, recorded beside it, so a rerun continues inside it
lock.py      one writer per share of OUT at a time
finalize.py  preparing OUT (whose files it holds, refusals, resume), finishing it (side files, card, index,
             config.json last)
card.py      the model card
"""
