"""Tests of mok.app: the command line and the training job."""
