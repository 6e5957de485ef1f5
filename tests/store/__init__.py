"""Tests of buildidd.store."""
