"""``python -m attnlab.bench [--quick] [--device cuda --dtype bf16] [--only SECTIONS] [--out DIR]``."""

from attnlab.bench.cli import main

main()
