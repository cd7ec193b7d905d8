"""Server-side batching (--enable_batching): the scheduler (scheduler.py) and its --batching_parameters_file
(parameters.py), as TF Serving's batching/."""
