"""Programs built on the library: the command line (`python -m mok`) and the training job."""
