"""Train a small MoE GPT with Megatron-core once per experts mode, on the same data from the same initial weights,
and check that the unpadded FP8 experts train exactly like their padded twins.

Usage, options and what each run checks: `--help` and the package's docstring (recipes/moe_gpt_recipe/__init__.py).

The recipe itself is the package next to this file, recipes/moe_gpt_recipe/ (its __init__ says what it trains and
checks), one module per concept: options (arguments and their refusals), megatron_core (megatron-core, imported for the
GPU job only), data, model (building), training (the loop), timing, checkpoints, results (summaries, --compare,
--same-bits), plots, launch (the checks before any work, then the job).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # megatron_tma from a source tree
sys.path.insert(0, HERE)  # the recipe's package (already there when this file runs as a script)

from moe_gpt_recipe.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
