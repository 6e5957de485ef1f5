"""Tests of buildidd.kernel."""
