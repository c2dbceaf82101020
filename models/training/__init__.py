"""Recipe that trains the embedded default model: synthetic speech, transducer losses, mixed precision.

Imports ``models`` only; nothing here is used at inference time.
"""
