package iotlake.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;

import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's local file system without libhadoop sets every file's permissions by forking
 * {@code chmod}, and reads link status (every FileContext rename) by forking {@code readlink}:
 * several processes per checkpoint or state-store file. This one does both with java.nio
 * (same results, no fork).
 */
public class NioRawLocalFileSystem extends RawLocalFileSystem {
  private static final PosixFilePermission[] BITS = {
    PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_READ,
    PosixFilePermission.GROUP_EXECUTE, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
    PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_READ,
  };

  static Set<PosixFilePermission> posix(FsPermission permission) {
    int mode = permission.toShort();
    Set<PosixFilePermission> set = EnumSet.noneOf(PosixFilePermission.class);
    for (int i = 0; i < BITS.length; i++) {
      if ((mode & (1 << i)) != 0) {
        set.add(BITS[i]);
      }
    }
    return set;
  }

  @Override
  public void setPermission(Path p, FsPermission permission) throws IOException {
    Files.setPosixFilePermissions(pathToFile(p).toPath(), posix(permission));
  }

  @Override
  public FileStatus getFileLinkStatus(Path f) throws IOException {
    if (!Files.isSymbolicLink(pathToFile(f).toPath())) {
      return getFileStatus(f);
    }
    return super.getFileLinkStatus(f);  // a real symlink: Hadoop's own handling
  }
}
