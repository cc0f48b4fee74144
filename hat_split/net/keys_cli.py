"""`hat-keys`: CurveZMQ keys for the device-cloud link.

    hat-keys generate NAME --dir DIR        NAME.key (public) and NAME.key_secret (secret, 0600); never overwrites
    hat-keys list --dir DIR                 every key there: name, public key, whether the secret is present
    hat-keys allow FILE.key --allow-dir DIR add a device's public key to the cloud's allow-list (read on the fly)
    hat-keys revoke NAME --allow-dir DIR    remove it (new connections with that key are refused)
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import List, Optional

from hat_split.net import security as S


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hat-keys", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="a new key pair")
    g.add_argument("name")
    g.add_argument("--dir", required=True)
    lst = sub.add_parser("list", help="the keys in a directory")
    lst.add_argument("--dir", required=True)
    a = sub.add_parser("allow", help="put a device's public key in the cloud's allow-list")
    a.add_argument("key")
    a.add_argument("--allow-dir", required=True)
    r = sub.add_parser("revoke", help="take a device's key out of the allow-list")
    r.add_argument("name")
    r.add_argument("--allow-dir", required=True)
    args = ap.parse_args(argv)
    try:
        if args.command == "generate":
            if not args.name.replace("-", "").replace("_", "").isalnum():
                raise ValueError("a key name is letters, digits, - and _")
            public, secret = S.generate(args.dir, args.name)
            print(f"{public} (public: give it to the other side)\n{secret} (secret: keep it on this host, mode 0600)")
        elif args.command == "list":
            d = Path(args.dir)
            if not d.is_dir():
                raise ValueError(f"{d} is not a directory")
            for key in sorted(d.glob("*.key")):
                secret = key.with_suffix(".key_secret").exists()
                print(f"{key.stem:24s} {S.load_public(str(key)).decode()}  {'public + secret' if secret else 'public'}")
        elif args.command == "allow":
            key = Path(args.key)
            if key.suffix != ".key":
                raise ValueError("give the public key file (NAME.key), never the secret one")
            S.load_public(str(key))  # refuses a file that is not a certificate
            Path(args.allow_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy(key, Path(args.allow_dir) / key.name)
            print(f"{key.stem} is allowed ({args.allow_dir})")
        elif args.command == "revoke":
            target = Path(args.allow_dir) / f"{args.name}.key"
            if not target.exists():
                raise ValueError(f"{args.name} is not in {args.allow_dir}")
            target.unlink()
            print(f"{args.name} is revoked")
    except (ValueError, OSError) as exc:
        print(f"hat-keys {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
