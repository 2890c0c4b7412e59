package pslaunch.yarntestbed;

import java.util.List;

import org.apache.hadoop.yarn.api.records.ApplicationId;
import org.apache.hadoop.yarn.api.records.ApplicationReport;
import org.apache.hadoop.yarn.api.records.YarnApplicationState;
import org.apache.hadoop.yarn.client.api.YarnClient;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.exceptions.ApplicationNotFoundException;

/**
 * The part of {@code yarn application} the testbed's {@code yarn} script needs, through Hadoop's
 * own {@link YarnClient}, printing what YARN's ApplicationCLI prints:
 * {@code -kill ID}, {@code -status ID}, {@code -list [-appStates all]}.
 */
public final class YarnCli {
  private YarnCli() {
  }

  public static void main(String[] args) throws Exception {
    YarnClient client = YarnClient.createYarnClient();
    client.init(new YarnConfiguration());
    client.start();
    try {
      System.exit(run(client, args));
    } finally {
      client.stop();
    }
  }

  private static int run(YarnClient client, String[] args) throws Exception {
    if (args.length == 2 && args[0].equals("-kill")) {
      ApplicationId id = ApplicationId.fromString(args[1]);
      ApplicationReport report = report(client, id);
      if (report == null) {
        return -1;
      }
      YarnApplicationState state = report.getYarnApplicationState();
      if (state == YarnApplicationState.FINISHED || state == YarnApplicationState.KILLED
          || state == YarnApplicationState.FAILED) {
        System.out.println("Application " + id + " has already finished ");
      } else {
        System.out.println("Killing application " + id);
        client.killApplication(id);  // returns once the kill is complete
      }
      return 0;
    }
    if (args.length == 2 && args[0].equals("-status")) {
      ApplicationReport r = report(client, ApplicationId.fromString(args[1]));
      if (r == null) {
        return -1;
      }
      System.out.println("Application Report : ");
      System.out.println("\tApplication-Id : " + r.getApplicationId());
      System.out.println("\tApplication-Name : " + r.getName());
      System.out.println("\tUser : " + r.getUser());
      System.out.println("\tQueue : " + r.getQueue());
      System.out.println("\tState : " + r.getYarnApplicationState());
      System.out.println("\tFinal-State : " + r.getFinalApplicationStatus());
      System.out.println("\tTracking-URL : " + r.getTrackingUrl());
      System.out.println("\tRPC Port : " + r.getRpcPort());
      System.out.println("\tAM Host : " + r.getHost());
      System.out.println("\tDiagnostics : " + r.getDiagnostics());
      return 0;
    }
    if (args.length >= 1 && args[0].equals("-list")) {
      boolean all = args.length == 3 && args[1].equals("-appStates") && args[2].equalsIgnoreCase("all");
      List<ApplicationReport> reports = client.getApplications();
      System.out.println("Total number of applications (application-types: [], states: "
          + (all ? "all" : "[SUBMITTED, ACCEPTED, RUNNING]") + "):" + reports.size());
      System.out.println("Application-Id\tApplication-Name\tApplication-Type\tUser\tQueue\tState\tFinal-State");
      for (ApplicationReport r : reports) {
        YarnApplicationState s = r.getYarnApplicationState();
        if (all || s == YarnApplicationState.SUBMITTED || s == YarnApplicationState.ACCEPTED
            || s == YarnApplicationState.RUNNING) {
          System.out.println(String.join("\t", r.getApplicationId().toString(), r.getName(),
              r.getApplicationType(), r.getUser(), r.getQueue(), s.toString(),
              r.getFinalApplicationStatus().toString()));
        }
      }
      return 0;
    }
    System.err.println("usage: yarn application -kill ID | -status ID | -list [-appStates ALL]");
    return 1;
  }

  private static ApplicationReport report(YarnClient client, ApplicationId id) throws Exception {
    try {
      return client.getApplicationReport(id);
    } catch (ApplicationNotFoundException e) {
      System.err.println("Application with id '" + id + "' doesn't exist in RM.");
      return null;
    }
  }
}
