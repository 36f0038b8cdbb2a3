"""The values that cross the scheduler/runner boundary in one engine step.

Both sides import this package and nothing of each other's: a `SchedulerOutput` can be pickled and
sent to a worker process, and a `ModelRunnerOutput` sent back.
"""
