"""What is on the device: the owner that carries out every phase change and the device buffers
it reuses (`placement`), parts placed apart from their group (`apart`), block slots
(`slots`), the one way a part moves in and out for both (`mover`), layer mode's streams
(`layers`), and re-packing a group whose modules changed (`adoption`).

No imports here: importing one module of the folder imports only what it needs."""
