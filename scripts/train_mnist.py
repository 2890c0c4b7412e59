#!/usr/bin/env python3
"""Run the MNIST trainer from a checkout: ``python scripts/train_mnist.py --network lenet ...``.

The same as ``python -m trainer.train_mnist``; see that module for the options.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.train_mnist import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
