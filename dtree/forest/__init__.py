"""The data: a forest of token sequences (Forest), its tries, padded rows, JSON Lines and the
checked conversion of user input."""
