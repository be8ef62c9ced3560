# Print sha1 of each .text.* section of a cubin (ELF64), by a substring filter.
import sys, struct, hashlib
data = open(sys.argv[1], 'rb').read()
shoff, = struct.unpack_from('<Q', data, 0x28); shentsize, shnum, shstrndx = struct.unpack_from('<HHH', data, 0x3A)
secs = [struct.unpack_from('<IIQQQQIIQQ', data, shoff + i * shentsize) for i in range(shnum)]
strtab = secs[shstrndx]; so = strtab[4]
def name(off): end = data.index(b'\0', so + off); return data[so + off:end].decode()
for s in secs:
    n = name(s[0])
    if n.startswith('.text.') and all(f in n for f in sys.argv[2:]):
        print(hashlib.sha1(data[s[4]:s[4] + s[5]]).hexdigest()[:12], s[5], n[-90:])
