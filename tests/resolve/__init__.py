"""Tests of buildidd.resolve."""
