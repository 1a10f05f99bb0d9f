"""``python -m attnlab.compare [name ...]``: the named models (``variant=<name>``) and the comparisons
(``python train.py -m compare=<name>``) there are; see :mod:`attnlab.training.compare`."""

if __name__ == "__main__":
    import attnlab.training.compare as compare

    raise SystemExit(compare.main())
