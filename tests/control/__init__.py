"""Tests of buildidd.control."""
