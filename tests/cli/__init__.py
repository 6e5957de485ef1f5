"""Tests of the command line (no BPF): parser, errors and exit codes, show, lookup, config options."""
