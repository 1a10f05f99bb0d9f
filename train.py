"""Train one attention variant (or sweep many with -m). A thin shim over attnlab.train.main; see the README."""

from attnlab.train import main

if __name__ == "__main__":
    main()
