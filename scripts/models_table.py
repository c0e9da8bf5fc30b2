#!/usr/bin/env python
"""Prints the model zoo table (parameters, training FLOPs per token/image) as markdown."""

from models._table import markdown

if __name__ == "__main__":
    print(markdown())
