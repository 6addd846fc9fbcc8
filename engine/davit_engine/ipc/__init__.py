"""The engine core in its own process, and the asyncio client the API process talks to it with.

The API process never imports torch through this package: the child process builds the engine
core after `spawn`, and only plain dataclasses (`messages.py`) cross the pipe.
"""
