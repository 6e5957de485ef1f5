"""Tests of buildidd.capture."""
