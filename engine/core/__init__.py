"""Torch-free bookkeeping: sequences, the block manager, the scheduler, text in and out, phase markers."""
