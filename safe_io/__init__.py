"""The ground floor of the project, standard library only, under every other package: files and folders opened
without following links (nofollow), and names from outside as a line of output shows them: a name that does not
print quoted (names), a URL without what may be a secret (urls). It imports nothing of the project, and not torch.
"""
